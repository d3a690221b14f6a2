"""kvserve tune: the tuning workflow and the re-plan alarm."""
