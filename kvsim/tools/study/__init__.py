"""The base every study type stands on (``kvsim closed-loop``, ``kvsim task``, and those to
come): reading its file (:mod:`.file`), the model with kvsim's caches inside it
(:mod:`.model`), the stepper grid (:mod:`.grid`), forked workers (:mod:`.workers`), the
report folder's CSV files and lines (:mod:`.report`), the run with its provenance and lock
and the redraw (:mod:`.run`), and the table of study types the command line is built from
(:mod:`.types`). A study type is a package beside it: ``config.py`` (its file) and
``command.py`` (its ``STUDY``, run and report); see docs/adding-a-study.md."""

