"""``python benchmarks/run.py SUITE [options]``: the same runner as ``revtrain bench SUITE``."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's revtrain

from revtrain.bench import runner  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python benchmarks/run.py")
    runner.add_arguments(parser)
    sys.exit(runner.main(parser.parse_args(), prog="python benchmarks/run.py"))
