"""Layer 5, report: the report folder (``writer``), its ``report.md`` (``markdown``), its
figures (``figures``) and the online-versus-offline H2O study (``h2o_study``)."""
