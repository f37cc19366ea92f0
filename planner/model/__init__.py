"""The model entry point and its capture as a graph of partition units."""
