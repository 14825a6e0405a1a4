"""`engy-node up`: a whole SN53 network on one machine (SPEC §11)."""
