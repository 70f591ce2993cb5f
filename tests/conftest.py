"""Suite-wide settings. `launch_local` ranks fork from a fork server that imported torch, dynabatch and
transformers once (``DYNABATCH_LAUNCH_START=forkserver``: ~0.3 s per rank instead of ~5-10 s for a fresh
interpreter); tests whose point is a fresh interpreter's start or teardown pin ``start_method="spawn"``
(or the environment variable). ``setdefault``: a run may still choose spawn for everything."""

import os

os.environ.setdefault("DYNABATCH_LAUNCH_START", "forkserver")
os.environ.setdefault("DYNABATCH_LAUNCH_PRELOAD", "transformers")
