"""The diff engine: replay and free-run comparisons of an engine trace against the reference."""
