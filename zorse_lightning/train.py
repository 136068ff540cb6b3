"""``python -m zorse_lightning.train recipe=NAME [overrides]``: plan and train."""

from zorse_lightning.apps.train_app import main

if __name__ == "__main__":
    main()
