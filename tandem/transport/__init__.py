"""Wire formats and transports between the three processes (see ARCHITECTURE.md)."""
