"""``python -m zorse_lightning.plan cluster=NAME model=NAME global_batch_size=N``."""

from zorse_lightning.apps.plan_app import main

if __name__ == "__main__":
    main()
