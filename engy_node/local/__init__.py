"""`engy-node up`: a whole SN53 network on one machine (docs/architecture.md)."""
