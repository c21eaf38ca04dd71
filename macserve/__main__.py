"""`python -m macserve ...`: what services run (an absolute interpreter path needs no shim)."""

from .cli import main

if __name__ == "__main__":
    main()
