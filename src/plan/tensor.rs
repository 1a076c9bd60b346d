//! Tensor parallelism's plan (Megatron-LM, Shoeybi et al. 2019): which ranks form a group, how
//! each parameter of a transformer layer is cut over a group's T ranks, and what the group
//! all-reduces per step. Pure arithmetic; the layers are in model/vit.rs, the cutting of
//! tensors in train/tensor.rs.
//!
//! In an encoder layer the attention's query/key/value projection is cut by heads (rows of its
//! weight and bias, within each of q, k and v) and the MLP's first linear layer by output
//! columns (rows of its weight and bias): each rank computes its heads and its part of the
//! hidden activations with no communication. The attention's output projection and the MLP's
//! second layer are cut by input columns: each rank's product is a partial sum, and the group
//! all-reduces it (their biases are added once, after the sum). Everything else (layer norms,
//! the embedding, the head) is whole on every rank.

use std::ops::Range;

/// How one parameter is cut over a tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Along dimension 0, which is `parts` equal blocks (q, k, v: 3), each cut in T.
    Rows { parts: usize },
    /// Along dimension 1 (a row-parallel layer's weight).
    Columns,
    /// Whole on every rank.
    Whole,
}

/// The cut of a ViT parameter, from its torchvision name.
pub fn vit_split(name: &str) -> Split {
    if !name.starts_with("encoder.layers.") {
        return Split::Whole;
    }
    if name.ends_with("self_attention.in_proj_weight") || name.ends_with("self_attention.in_proj_bias") {
        Split::Rows { parts: 3 }
    } else if name.ends_with("mlp.0.weight") || name.ends_with("mlp.0.bias") {
        Split::Rows { parts: 1 }
    } else if name.ends_with("self_attention.out_proj.weight") || name.ends_with("mlp.3.weight") {
        Split::Columns
    } else {
        Split::Whole
    }
}

/// The indices along the cut dimension that rank `rank` of `size` holds, in the order it holds
/// them, for a whole extent of `extent` (dimension 0 for rows, 1 for columns). Every extent this
/// is asked of divides evenly ([`check_divides`]).
#[allow(clippy::single_range_in_vec_init)]
pub fn held(split: Split, extent: usize, rank: usize, size: usize) -> Vec<Range<usize>> {
    match split {
        Split::Whole => vec![0..extent],
        Split::Columns => {
            let part = extent / size;
            vec![rank * part..(rank + 1) * part]
        }
        Split::Rows { parts } => {
            let block = extent / parts;
            let part = block / size;
            (0..parts).map(|b| b * block + rank * part..b * block + (rank + 1) * part).collect()
        }
    }
}

/// Why a transformer of `heads` heads and an MLP of `mlp` cannot be cut over `size` ranks.
pub fn check_divides(model: &str, heads: usize, mlp: usize, size: usize) -> Result<(), String> {
    if size == 0 || !heads.is_multiple_of(size) {
        return Err(format!(
            "--tensor-parallel {size} does not divide the {heads} attention heads of --model {model}: each rank computes whole heads; use a divisor of {heads}"
        ));
    }
    if !mlp.is_multiple_of(size) {
        return Err(format!("--tensor-parallel {size} does not divide the MLP width {mlp} of --model {model}; use a divisor of {mlp}"));
    }
    Ok(())
}

/// Which ranks work together, N = D x P x T: tensor-parallel groups on consecutive ranks (they
/// exchange activations in every layer, so they share a node where the launcher fills nodes in
/// order), pipeline stages next, data-parallel replicas outermost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub data: usize,
    pub pipeline: usize,
    pub tensor: usize,
}

impl Layout {
    pub fn new(ranks: usize, pipeline: usize, tensor: usize) -> Result<Layout, String> {
        if tensor == 0 || pipeline == 0 || !ranks.is_multiple_of(pipeline * tensor) {
            return Err(format!(
                "--tensor-parallel {tensor} x --pipeline-stages {pipeline} = {} does not divide the {ranks} ranks: the ranks form (ranks / (P x T)) replicas of P stages of T ranks each",
                tensor * pipeline
            ));
        }
        Ok(Layout { data: ranks / (pipeline * tensor), pipeline, tensor })
    }

    /// The rank's place in its tensor-parallel group.
    pub fn tensor_rank(&self, rank: usize) -> usize {
        rank % self.tensor
    }

    /// The tensor-parallel group the rank is in (consecutive ranks).
    pub fn tensor_group(&self, rank: usize) -> usize {
        rank / self.tensor
    }

    /// The ranks that hold the same parameters (same stage, same tensor-parallel rank), which
    /// average their gradients: the rank's position within its replica names them.
    pub fn data_group(&self, rank: usize) -> usize {
        rank % (self.pipeline * self.tensor)
    }

    pub fn describe(&self) -> String {
        format!("{} x {} x {} (data x pipeline x tensor)", self.data, self.pipeline, self.tensor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_is_held_once_across_the_group() {
        for (split, extent) in [(Split::Rows { parts: 3 }, 192), (Split::Rows { parts: 1 }, 128), (Split::Columns, 64)] {
            for size in [1, 2, 4] {
                let mut seen = vec![0; extent];
                for rank in 0..size {
                    let ranges = held(split, extent, rank, size);
                    assert_eq!(ranges.iter().map(|r| r.len()).sum::<usize>(), extent / size);
                    for i in ranges.into_iter().flatten() {
                        seen[i] += 1;
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "{split:?} {size}");
            }
        }
        // q, k and v each give rank 1 of 2 its second half of the heads.
        assert_eq!(held(Split::Rows { parts: 3 }, 12, 1, 2), vec![2..4, 6..8, 10..12]);
        assert_eq!(held(Split::Whole, 5, 1, 2), vec![0..5]);
    }

    #[test]
    fn the_vit_names_cut_as_megatron_does() {
        let layer = "encoder.layers.encoder_layer_3.";
        assert_eq!(vit_split(&format!("{layer}self_attention.in_proj_weight")), Split::Rows { parts: 3 });
        assert_eq!(vit_split(&format!("{layer}self_attention.in_proj_bias")), Split::Rows { parts: 3 });
        assert_eq!(vit_split(&format!("{layer}mlp.0.bias")), Split::Rows { parts: 1 });
        assert_eq!(vit_split(&format!("{layer}self_attention.out_proj.weight")), Split::Columns);
        assert_eq!(vit_split(&format!("{layer}mlp.3.weight")), Split::Columns);
        for whole in ["self_attention.out_proj.bias", "mlp.3.bias", "ln_1.weight", "ln_2.bias"] {
            assert_eq!(vit_split(&format!("{layer}{whole}")), Split::Whole, "{whole}");
        }
        for whole in ["encoder.ln.weight", "encoder.pos_embedding", "conv_proj.weight", "class_token", "heads.head.weight"] {
            assert_eq!(vit_split(whole), Split::Whole, "{whole}");
        }
    }

    #[test]
    fn groups_are_consecutive_and_replicas_outermost() {
        let layout = Layout::new(8, 1, 2).unwrap();
        assert_eq!(layout.data, 4);
        assert_eq!((0..8).map(|r| layout.tensor_group(r)).collect::<Vec<_>>(), [0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!((0..8).map(|r| layout.data_group(r)).collect::<Vec<_>>(), [0, 1, 0, 1, 0, 1, 0, 1]);
        let layout = Layout::new(8, 2, 2).unwrap();
        assert_eq!((layout.data, layout.tensor_group(5), layout.data_group(5), layout.tensor_rank(5)), (2, 2, 1, 1));
        let why = Layout::new(6, 1, 4).unwrap_err();
        assert!(why.contains("does not divide the 6 ranks"), "{why}");
        assert!(Layout::new(12, 3, 2).is_ok());
    }

    #[test]
    fn heads_and_mlp_must_divide() {
        assert!(check_divides("vit-b16", 12, 3072, 4).is_ok());
        let why = check_divides("vit-b16", 12, 3072, 8).unwrap_err();
        assert!(why.contains("12 attention heads"), "{why}");
        let why = check_divides("x", 4, 6, 4).unwrap_err();
        assert!(why.contains("MLP width 6"), "{why}");
    }
}
