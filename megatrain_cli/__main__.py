from megatrain_cli.cli import main

if __name__ == "__main__":  # spawned ranks (train/launch.py) import this module as __mp_main__
    main()
