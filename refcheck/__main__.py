from refcheck.cli import entry

entry()
