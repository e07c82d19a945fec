"""Former home of ``python -m dyncp.profiling.profile`` (it imports torch, so it moved out of
the torch-free cost model); kept so that ``python -m dyncp.cost_model.profile`` still runs."""

from dyncp.profiling.profile import main

if __name__ == "__main__":
    main()
