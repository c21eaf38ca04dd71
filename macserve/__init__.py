"""macserve: a dependable home for large local models on a Mac Studio."""

__version__ = "0.1.0"
