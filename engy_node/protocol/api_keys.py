"""What the gateway's keys look like on the wire: a buyer's API key (`Authorization: Bearer
engy-sk-…`) and a miner's key (its hello's `key`, `engy-mk-…`). Each kind has its own prefix so
a key of one kind never authenticates the other, and so tools that print logs or configs
(`engy-node diagnose`) can mask every key without knowing the gateway's store.
"""

BUYER_KEY_PREFIX = "engy-sk-"
MINER_KEY_PREFIX = "engy-mk-"
