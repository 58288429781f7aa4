import sys

from crucible.distributed.cli import launch_main

sys.exit(launch_main(sys.argv[1:]))
