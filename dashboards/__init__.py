"""dashboards package (see DESIGN.md)."""
