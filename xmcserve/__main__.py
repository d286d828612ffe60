import sys

from xmcserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
