from imerge.cli import run

run()
