"""`python -m llamatune`: the `llamatune` command."""
from llamatune.cli.main import main

if __name__ == "__main__":
    main()
