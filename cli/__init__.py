"""Command-line interface for llamatune."""
