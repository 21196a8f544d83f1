"""Template filters of the portal."""
