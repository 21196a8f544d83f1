"""Record formats: how input files become records and how records are checked."""
