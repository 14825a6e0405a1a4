"""Wire schemas shared by peers (and by engy_tui): encode/decode with validation, no IO."""
