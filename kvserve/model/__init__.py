"""Model code that reads and writes the paged cache. Knows nothing about scheduling."""
