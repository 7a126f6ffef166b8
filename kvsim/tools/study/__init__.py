"""The base every study type stands on (``kvsim closed-loop``, ``kvsim task``, and those to
come): reading its file (:mod:`.file`), the model with kvsim's caches inside it
(:mod:`.model`), the stepper grid (:mod:`.grid`), forked workers (:mod:`.workers`), the
report folder's CSV files and lines (:mod:`.report`), the run with its provenance and lock
and the redraw (:mod:`.run`), and the table of study types the command line is built from
(:mod:`.types`). A study type is a package beside it: ``config.py`` (its file) and
``command.py`` (its ``STUDY``, run and report); see docs/adding-a-study.md."""

from kvsim.tools.study.file import (BOOTSTRAP, MODEL_SETTINGS, check_context, read_focus,
                                    read_model, read_output, read_steppable_policies,
                                    read_study_file)
from kvsim.tools.study.report import (figure_lines, machine_words, settings_of,
                                      version_lines)
from kvsim.tools.study.run import provenance, write_study

__all__ = ["BOOTSTRAP", "MODEL_SETTINGS", "check_context", "figure_lines", "machine_words",
           "provenance", "read_focus", "read_model", "read_output", "read_steppable_policies",
           "read_study_file", "settings_of", "version_lines", "write_study"]
