-- One Postgres server, two databases: Prefect's and the Crucible registry's.
CREATE DATABASE prefect;
CREATE DATABASE crucible;
