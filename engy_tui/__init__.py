"""engy-tui: the Textual node manager around the headless `engy_node` core."""
