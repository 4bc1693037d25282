"""Data for the examples: an embedded byte-level corpus and stateful window streams."""
