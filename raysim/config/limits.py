"""raysim's documented maxima (docs/security.md): a count past these is a typo or an attack, and would hang or
exhaust the machine. Their one home: the config checks and the parts that read their own inputs (a PFLlib
folder's client count, raysim.data.pfllib_folder) import them from here. Imports nothing of raysim."""

from __future__ import annotations

MAX_ROUNDS = 1_000_000
MAX_CLIENTS = 100_000
MAX_LOCAL_EPOCHS = 10_000
MAX_BATCH_SIZE = 1_000_000
MAX_N_CTX = 1_000
MAX_CTX_INIT_CHARS = 1_000
MAX_AUGMENT_VIEWS = 256  # features of every view are held in memory: N x views x D floats
