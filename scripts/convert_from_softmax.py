#!/usr/bin/env python
"""`rfa-convert-from-softmax` (rfa_fairseq/cli/convert_from_softmax.py), kept runnable as `python scripts/convert_from_softmax.py`."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E401,E702
from rfa_fairseq.cli.convert_from_softmax import main  # noqa: E402
if __name__ == "__main__":
    main()
