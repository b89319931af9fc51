#!/usr/bin/env python
"""`rfa-redraw-features` (rfa_fairseq/cli/redraw_features.py), kept runnable as `python scripts/redraw_features.py`."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E401,E702
from rfa_fairseq.cli.redraw_features import main  # noqa: E402
if __name__ == "__main__":
    main()
