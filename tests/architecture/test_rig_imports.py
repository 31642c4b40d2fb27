"""The product does not import the rig (issue 30): no module under libs/ or services/ imports
tools.*. Simulated hardware and the IMEX simulator live in tools/sim and are reached through the
ports (libs/hardware/factory.py, libs/imex/daemon_port.py), which load them by name at run time.

Every module under libs/ (without libs/gen) and services/ is parsed with `ast`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.hardware.factory import SIMULATED_HARDWARE
from libs.imex.daemon_port import SIMULATED_IMEX, ImexDaemon
from libs.runtime.stand_ins import load_standin
from tools.arch_figures import rig_imports

REPO = Path(__file__).resolve().parents[2]


def test_no_product_module_imports_the_rig() -> None:
    found = rig_imports(REPO)
    assert not found, (
        "libs/ or services/ import tools; reach a stand-in through its port "
        "(libs/runtime/stand_ins.py loads it by name):\n"
        + "\n".join(f"  {c.path}:{c.line} imports {c.imported}" for c in found)
    )


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ("libs/hardware/factory.py", "from tools.sim.hardware.simulated import SimulatedNodeHardware"),
        ("libs/hardware/factory.py", "import tools.sim.hardware.simulated"),
        ("services/imexagent/runner.py", "from tools.sim import imex"),
        ("services/imexagent/runner.py", "import tools"),
        ("services/imexagent/runner.py", "def spawn():\n    from tools.sim.imex.launch import fork_server\n"),
    ],
)
def test_a_rig_import_is_found_in_every_form(tmp_path: Path, path: str, line: str) -> None:
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(f"{line}\n")

    assert [(c.path, c.line) for c in rig_imports(tmp_path)] == [(path, 1 if "def" not in line else 2)]


def test_names_of_tools_in_strings_and_the_rig_itself_are_not_imports(tmp_path: Path) -> None:
    (tmp_path / "libs" / "hardware").mkdir(parents=True)
    (tmp_path / "libs" / "hardware" / "factory.py").write_text('SIM = "tools.sim.hardware.simulated:X"\n')
    (tmp_path / "tools" / "sim").mkdir(parents=True)
    (tmp_path / "tools" / "sim" / "port.py").write_text("from tools.sim.imex import ctl\n")

    assert rig_imports(tmp_path) == []


def test_the_stand_ins_the_ports_name_exist() -> None:
    open_simulated_hardware = load_standin(SIMULATED_HARDWARE)
    open_simulated_imex = load_standin(SIMULATED_IMEX)

    assert callable(open_simulated_hardware)
    assert callable(open_simulated_imex) and isinstance(open_simulated_imex(), ImexDaemon)


def test_a_malformed_stand_in_name_is_refused_with_its_text() -> None:
    with pytest.raises(ValueError, match=r"tools\.sim\.imex\.port"):
        load_standin("tools.sim.imex.port")
