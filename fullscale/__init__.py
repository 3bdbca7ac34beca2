"""fullscale package."""
