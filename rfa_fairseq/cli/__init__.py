"""The command line tools, installed as console commands (setup.py's ``console_scripts``):

- ``rfa-convert-from-softmax`` (:mod:`.convert_from_softmax`): a fairseq softmax transformer
  checkpoint into the matching RFA model, ready to finetune;
- ``rfa-redraw-features`` (:mod:`.redraw_features`): a copy of an RFA checkpoint with new random
  matrices, optionally more of them;
- ``rfa-diagnostics`` (:mod:`.diagnostics`): sigma, mean gate and clamped denominators of a
  trained model's RFA attention on a data split;
- ``rfa-average-checkpoints`` (:mod:`.average_checkpoints`): the average of the last N
  checkpoints, random feature matrices taken from the newest.

Each module has ``main(argv=None)`` and runs as ``python -m rfa_fairseq.cli.NAME`` too.
"""
