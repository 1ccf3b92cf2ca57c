"""The recipe for a user's own labelled images: statistics (stats.py) -> decisions (decide.py)."""
