"""api package (see DESIGN.md)."""
