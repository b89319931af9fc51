"""The command line tools, one module each (its docstring says what it does), installed as ``rfa-*`` console commands
(setup.py's ``console_scripts``), each with ``main(argv=None)``, runnable as ``python -m rfa_fairseq.cli.NAME`` too."""
