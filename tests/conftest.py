import os
import sys
from pathlib import Path

# Lessons live at the repository root and are imported by file name (load_lesson); the test
# processes and the rank processes they spawn need the root on sys.path to find them.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The torchrun runs some tests start (checkpoints, the README's commands) run on the CPU over gloo
# on a machine with GPUs too: they start more ranks than it has GPUs (see topology.rank_device).
os.environ.setdefault("PICOTRON_LIKE_DEVICE", "cpu")
