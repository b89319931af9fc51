#!/usr/bin/env python
"""`rfa-diagnostics` (rfa_fairseq/cli/diagnostics.py), kept runnable as `python scripts/rfa_diagnostics.py`."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E401,E702
from rfa_fairseq.cli.diagnostics import main  # noqa: E402
if __name__ == "__main__":
    main()
