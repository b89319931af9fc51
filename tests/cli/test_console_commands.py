"""The console commands setup.py declares: each is installed with the package, resolves to a
callable main(argv=None), and answers --help with exit status 0."""
import importlib.metadata
import os
import subprocess

import pytest

from rfa_test_utils import BIN, REPO

COMMANDS = {
    "rfa-convert-from-softmax": "rfa_fairseq.cli.convert_from_softmax:main",
    "rfa-redraw-features": "rfa_fairseq.cli.redraw_features:main",
    "rfa-diagnostics": "rfa_fairseq.cli.diagnostics:main",
    "rfa-average-checkpoints": "rfa_fairseq.cli.average_checkpoints:main",
    "rfa-translate-documents": "rfa_fairseq.cli.translate_documents:main",
}


def installed():
    dist = importlib.metadata.distribution("rfa_fairseq")
    return {ep.name: ep for ep in dist.entry_points if ep.group == "console_scripts"}


def test_setup_py_declares_the_commands():
    text = open(os.path.join(REPO, "setup.py"), encoding="utf-8").read()
    for name, target in COMMANDS.items():
        assert f'"{name} = {target}"' in text, name


def test_installed_metadata_has_the_commands():
    """What pip installed (re-run scripts/setup_env.sh, or pip install --no-build-isolation
    --no-deps -e ., after changing setup.py's entry points)."""
    assert {name: ep.value for name, ep in installed().items()} == COMMANDS


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_main_is_callable_and_prints_help(name, capsys):
    main = installed()[name].load()
    assert callable(main)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_installed_command_prints_help(name):
    proc = subprocess.run([os.path.join(BIN, name), "--help"], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {name}"), proc.stderr[-2000:]
