#!/usr/bin/env python
"""`rfa-average-checkpoints` (rfa_fairseq/cli/average_checkpoints.py), kept runnable as `python scripts/average_checkpoints.py`."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E401,E702
from rfa_fairseq.cli.average_checkpoints import main  # noqa: E402
if __name__ == "__main__":
    main()
