"""The library contract suite (kselect.core.contract.checks) run against every library plugin that is
available here, on real kernels: what a third-party library must pass too."""

from __future__ import annotations

import pytest

from kselect.core.contract import plugins
from kselect.core.contract.checks import ContractError, check_library, library_checks
from kselect.core.contract.library import Library
from kselect.plugins.mlas.library import MlasLibrary

LIBRARIES = sorted(plugins.libraries())


def _checks():
    for name in LIBRARIES:
        library = plugins.libraries()[name]
        if not library.availability()[0]:
            continue
        marks = [pytest.mark.emulated] if library.emulated else []
        for check in library_checks(library):
            yield pytest.param(check, id=f"{name}-{check.name}", marks=marks)


@pytest.mark.parametrize("check", list(_checks()))
def test_library_keeps_the_contract(check):
    check()


def test_every_built_in_library_is_checked():
    assert {"mlas", "xnnpack", "acl", "openvino"} <= set(LIBRARIES)


def test_a_library_missing_a_required_method_cannot_be_instantiated():
    class Incomplete(Library):
        name = "incomplete"

        def version(self):
            return "1"

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


class WrongBias(MlasLibrary):
    """Real MLAS kernels fed a bias that is off: they run fine and compute the wrong thing. The
    measuring child builds an instance of this class (it imports this module), not MLAS's own."""

    def prepare(self, task, config, inputs):
        shifted = dict(inputs, b=inputs["b"] + 1.0) if "b" in inputs else inputs
        return super().prepare(task, config, shifted)


def test_a_library_computing_the_wrong_thing_fails_the_suite():
    with pytest.raises(ContractError, match="tunes_and_measures_its_defaults.*differs from reference"):
        check_library(WrongBias())


def test_the_baseline_is_declared_by_a_plugin_not_named_in_core():
    baseline = plugins.baseline_library()
    assert baseline.name == "mlas" and baseline.baseline
    assert [lib.name for lib in plugins.libraries().values() if lib.baseline] == ["mlas"]
