"""The lowest layer of jmamba: dtype rules, argument checks, the precision type, mesh axis names,
parameter tags and deprecation helpers. Imports nothing else from jmamba (see docs/architecture.md)."""
