"""The development stack: the whole platform on one machine (`manage.py up`, `make demo`), with an
embedded Redis and a SQLite database where nothing is configured."""
