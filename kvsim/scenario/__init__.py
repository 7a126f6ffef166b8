"""Layer 3, scenario: a TOML file (plus command-line overrides) into a validated, frozen
:class:`~kvsim.scenario.load.Scenario` (``load``, ``overrides``)."""
