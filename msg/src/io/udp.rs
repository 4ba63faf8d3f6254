//! Kernel UDP with segmentation offload (written next).
