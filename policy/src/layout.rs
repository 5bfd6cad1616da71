//! The flat parameter layout: where every weight matrix and bias vector of a [`PolicySpec`]
//! lives in the single `f32` parameter buffer, and a stable hash that names the architecture.

use std::ops::Range;

use super::{
    ActionHead, ConvGeometry, CoreKind, PolicyError, PolicySpec, MAX_LAYER_WIDTH, MAX_PARAMS, MAX_TORSO_LAYERS,
};

/// One named block of the flat parameter buffer: a row-major `rows × cols` matrix starting at
/// `offset`. Bias vectors are `1 × width` rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamEntry {
    /// Dotted name, e.g. `"torso.0.weight"`, `"gru.weight_hh"`, `"value.bias"`.
    pub name: String,
    /// Index of the block's first element in the flat buffer.
    pub offset: usize,
    /// Number of rows (output units for a weight, 1 for a bias).
    pub rows: usize,
    /// Number of columns (input units for a weight, output units for a bias).
    pub cols: usize,
}

impl ParamEntry {
    /// Number of `f32`s in the block (`rows * cols`).
    pub fn n_elements(&self) -> usize {
        self.rows * self.cols
    }

    /// The block's index range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.n_elements()
    }
}

/// Offsets of one linear layer `Y = X Wᵀ + b` with `W: [n_out][n_in]`, `b: [n_out]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DenseOffsets {
    pub(crate) weight: usize,
    pub(crate) bias: usize,
    pub(crate) n_in: usize,
    pub(crate) n_out: usize,
}

impl DenseOffsets {
    pub(crate) fn weight<'p>(&self, params: &'p [f32]) -> &'p [f32] {
        &params[self.weight..self.weight + self.n_out * self.n_in]
    }

    pub(crate) fn bias<'p>(&self, params: &'p [f32]) -> &'p [f32] {
        &params[self.bias..self.bias + self.n_out]
    }
}

/// Offsets of the GRU core; gate blocks are stacked `r, z, n` along the rows (PyTorch order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GruOffsets {
    pub(crate) weight_ih: usize,
    pub(crate) weight_hh: usize,
    pub(crate) bias_ih: usize,
    pub(crate) bias_hh: usize,
    pub(crate) n_in: usize,
    pub(crate) hidden: usize,
}

impl GruOffsets {
    /// The input-to-hidden weights `W_i = [W_ir; W_iz; W_in]`, `[3H][n_in]`.
    pub(crate) fn weight_ih<'p>(&self, params: &'p [f32]) -> &'p [f32] {
        &params[self.weight_ih..self.weight_ih + 3 * self.hidden * self.n_in]
    }

    /// The hidden-to-hidden weights `W_h = [W_hr; W_hz; W_hn]`, `[3H][H]`.
    pub(crate) fn weight_hh<'p>(&self, params: &'p [f32]) -> &'p [f32] {
        &params[self.weight_hh..self.weight_hh + 3 * self.hidden * self.hidden]
    }

    pub(crate) fn bias_ih<'p>(&self, params: &'p [f32]) -> &'p [f32] {
        &params[self.bias_ih..self.bias_ih + 3 * self.hidden]
    }

    pub(crate) fn bias_hh<'p>(&self, params: &'p [f32]) -> &'p [f32] {
        &params[self.bias_hh..self.bias_hh + 3 * self.hidden]
    }
}

/// How [`ParamLayout::init_params`] fills an entry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum InitRule {
    /// Zeros (all biases).
    Zeros,
    /// Ones (the observation variances' start).
    Ones,
    /// Orthogonal with `gain`, drawn independently for each of `blocks` equal row blocks (the
    /// GRU's per-gate matrices); `blocks == 1` for an ordinary layer.
    Orthogonal { gain: f32, blocks: usize },
}

/// Where every parameter of a [`PolicySpec`] lives in one flat `f32` buffer.
///
/// Entries, in buffer order, with `F` the torso output width (`obs_dim` if the torso is empty),
/// `H` the GRU hidden size, `F'` the heads' input width (`H` with a GRU, else `F`) and
/// `A = n_actions`:
///
/// | name               | shape (rows × cols)      | init (cleanrl `layer_init`)          |
/// |--------------------|--------------------------|--------------------------------------|
/// | `conv.{i}.weight`  | `OC_i × C_i·K_i·K_i`     | orthogonal, gain √2                  |
/// | `conv.{i}.bias`    | `1 × OC_i`               | 0                                    |
/// | `torso.{i}.weight` | `torso[i] × in_i`        | orthogonal, gain √2                  |
/// | `torso.{i}.bias`   | `1 × torso[i]`           | 0                                    |
/// | `gru.weight_ih`    | `3H × F` (gates r, z, n) | orthogonal per gate block, gain √2   |
/// | `gru.weight_hh`    | `3H × H` (gates r, z, n) | orthogonal per gate block, gain 1    |
/// | `gru.bias_ih`      | `1 × 3H`                 | 0                                    |
/// | `gru.bias_hh`      | `1 × 3H`                 | 0                                    |
/// | `critic.{i}.weight`| `critic[i] × in_i`       | orthogonal, gain √2                  |
/// | `critic.{i}.bias`  | `1 × critic[i]`          | 0                                    |
/// | `policy.weight`    | `A × F'`                 | orthogonal, gain 0.01                |
/// | `value.weight`     | `1 × V`                  | orthogonal, gain 1                   |
/// | `policy.bias`      | `1 × A`                  | 0                                    |
/// | `value.bias`       | `1 × 1`                  | 0                                    |
/// | `policy.log_std`   | `1 × A`                  | 0 (σ = 1)                            |
/// | `obs_norm.mean`    | `1 × obs_dim`            | 0                                    |
/// | `obs_norm.var`     | `1 × obs_dim`            | 1                                    |
/// | `obs_norm.count`   | `1 × 1`                  | 0                                    |
///
/// The `conv.*` entries exist only with a conv torso ([`PolicySpec::conv`]); a conv weight is
/// PyTorch's `[OC][C][K][K]` flattened, and the first dense layer then reads the last conv
/// layer's `OH·OW·OC` outputs in channel-last order (see `conv.rs`).
/// The `gru.*` entries exist only for [`CoreKind::Gru`], and `policy.log_std` only for an
/// [`ActionHead::Gaussian`] head, whose policy head outputs the `A` means; it comes last, so
/// every other offset is the same as for a categorical head of the same width. The `critic.*`
/// entries exist only with a separate value network ([`PolicySpec::critic`]): its first layer
/// reads the observations (`in_0 = obs_dim`), and the value head then reads its last layer
/// (`V = critic[last]`; without one `V = F'`). The `obs_norm.*`
/// entries exist only with [`PolicySpec::normalize_obs`]: running statistics the learner
/// updates (not trained by gradient) and every forward reads ([`crate::obs_norm`]).
///
/// Weights are row-major `[out][in]` (PyTorch's `nn.Linear`/`nn.GRU` convention), so a layer computes `Y = X Wᵀ + b` on a batch
/// `X: [n][in]`. The value head is stored right after the policy head (weights, then biases),
/// so without a separate value network the two heads form one contiguous `(A + 1) × F'` matrix
/// and one `A + 1` bias that a single GEMM evaluates; output column `A` is the value.
///
/// The GRU follows PyTorch's gate convention (Cho et al. 2014, eq. 5–8, with the reset gate
/// applied after the hidden matmul):
///
/// ```text
/// r  = σ(W_ir x + b_ir + W_hr h + b_hr)
/// z  = σ(W_iz x + b_iz + W_hz h + b_hz)
/// n  = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))
/// h' = (1 − z) ⊙ n + z ⊙ h
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ParamLayout {
    spec: PolicySpec,
    entries: Vec<ParamEntry>,
    init_rules: Vec<InitRule>,
    n_params: usize,
    hash: u64,
    conv: Vec<DenseOffsets>,
    conv_geometries: Vec<ConvGeometry>,
    torso: Vec<DenseOffsets>,
    gru: Option<GruOffsets>,
    heads: DenseOffsets,
    /// The separate value network's layers ([`PolicySpec::critic`]; empty without one).
    critic: Vec<DenseOffsets>,
    /// The value head when it reads the separate value network (`1 × C`); `None` when it is
    /// fused into [`heads`](Self::heads) as its last row.
    value: Option<DenseOffsets>,
    /// Offset of `policy.log_std` (Gaussian heads only).
    log_std: Option<usize>,
    /// Offset of the `obs_norm.*` statistics (with `normalize_obs` only).
    obs_norm: Option<usize>,
}

impl ParamLayout {
    /// Validate `spec` and lay its parameters out.
    ///
    /// Fails with [`PolicyError::InvalidSpec`] when a size is zero, above [`MAX_LAYER_WIDTH`],
    /// or the torso is deeper than [`MAX_TORSO_LAYERS`], and with
    /// [`PolicyError::TooManyParams`] above [`MAX_PARAMS`] parameters.
    ///
    /// ```
    /// use volley_policy::{Activation, ParamLayout, PolicySpec};
    /// let layout = ParamLayout::new(&PolicySpec::mlp(4, 2, &[64, 64], Activation::Tanh)).unwrap();
    /// // 4·64+64 + 64·64+64 + (2+1)·64 + (2+1)
    /// assert_eq!(layout.n_params(), 4675);
    /// ```
    pub fn new(spec: &PolicySpec) -> Result<Self, PolicyError> {
        validate(spec)?;
        let mut builder = Builder::default();
        let mut n_in = spec.obs_dim;
        let sqrt2 = std::f32::consts::SQRT_2;
        let conv_geometries = match &spec.conv {
            Some(conv) => conv.geometries()?,
            None => Vec::new(),
        };
        let mut conv = Vec::with_capacity(conv_geometries.len());
        for (layer_idx, geometry) in conv_geometries.iter().enumerate() {
            let (n_out, patch) = (geometry.out_channels, geometry.patch_len());
            let weight = builder.push(
                format!("conv.{layer_idx}.weight"),
                n_out,
                patch,
                InitRule::Orthogonal { gain: sqrt2, blocks: 1 },
            );
            let bias = builder.push(format!("conv.{layer_idx}.bias"), 1, n_out, InitRule::Zeros);
            conv.push(DenseOffsets { weight, bias, n_in: patch, n_out });
            n_in = geometry.output_len();
        }
        let torso = builder.push_dense_stack("torso", &spec.torso, n_in);
        n_in = torso.last().map_or(n_in, |layer| layer.n_out);
        let gru = match spec.core {
            CoreKind::Mlp => None,
            CoreKind::Gru { hidden } => {
                // Input weights get the torso's ReLU/tanh gain; recurrent weights gain 1 so the
                // linearised recurrence starts norm-preserving (Saxe et al. 2014).
                let weight_ih = builder.push(
                    "gru.weight_ih".into(),
                    3 * hidden,
                    n_in,
                    InitRule::Orthogonal { gain: sqrt2, blocks: 3 },
                );
                let weight_hh = builder.push(
                    "gru.weight_hh".into(),
                    3 * hidden,
                    hidden,
                    InitRule::Orthogonal { gain: 1.0, blocks: 3 },
                );
                let bias_ih = builder.push("gru.bias_ih".into(), 1, 3 * hidden, InitRule::Zeros);
                let bias_hh = builder.push("gru.bias_hh".into(), 1, 3 * hidden, InitRule::Zeros);
                let offsets = GruOffsets { weight_ih, weight_hh, bias_ih, bias_hh, n_in, hidden };
                n_in = hidden;
                Some(offsets)
            }
        };
        // A separate value network reads the observations; without one the value head reads
        // the policy's features.
        let critic = builder.push_dense_stack("critic", &spec.critic, spec.obs_dim);
        let value_in = critic.last().map_or(n_in, |layer| layer.n_out);
        let n_actions = spec.n_actions;
        let policy_weight =
            builder.push("policy.weight".into(), n_actions, n_in, InitRule::Orthogonal { gain: 0.01, blocks: 1 });
        let value_weight =
            builder.push("value.weight".into(), 1, value_in, InitRule::Orthogonal { gain: 1.0, blocks: 1 });
        let policy_bias = builder.push("policy.bias".into(), 1, n_actions, InitRule::Zeros);
        let value_bias = builder.push("value.bias".into(), 1, 1, InitRule::Zeros);
        let log_std = match spec.head {
            ActionHead::Categorical => None,
            ActionHead::Gaussian { .. } => Some(builder.push("policy.log_std".into(), 1, n_actions, InitRule::Zeros)),
        };
        let obs_norm = spec.normalize_obs.then(|| {
            let mean = builder.push("obs_norm.mean".into(), 1, spec.obs_dim, InitRule::Zeros);
            builder.push("obs_norm.var".into(), 1, spec.obs_dim, InitRule::Ones);
            builder.push("obs_norm.count".into(), 1, 1, InitRule::Zeros);
            mean
        });
        // Without a separate value network the value head's row follows the policy head's, so
        // the two are one `(A + 1) × F'` product; with one, each head is its own product.
        let (heads, value) = if critic.is_empty() {
            (DenseOffsets { weight: policy_weight, bias: policy_bias, n_in, n_out: n_actions + 1 }, None)
        } else {
            let value = DenseOffsets { weight: value_weight, bias: value_bias, n_in: value_in, n_out: 1 };
            (DenseOffsets { weight: policy_weight, bias: policy_bias, n_in, n_out: n_actions }, Some(value))
        };
        let Builder { entries, init_rules, n_params } = builder;
        let mut layout = ParamLayout {
            spec: spec.clone(),
            entries,
            init_rules,
            n_params,
            hash: 0,
            conv,
            conv_geometries,
            torso,
            gru,
            heads,
            critic,
            value,
            log_std,
            obs_norm,
        };
        layout.hash = layout.compute_hash();
        Ok(layout)
    }

    /// The spec this layout was built from.
    pub fn spec(&self) -> &PolicySpec {
        &self.spec
    }

    /// Total number of parameters (the flat buffer's length).
    pub fn n_params(&self) -> usize {
        self.n_params
    }

    /// All parameter blocks in buffer order; they tile `0..n_params` without gaps.
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    /// The entry called `name`, if any.
    pub fn entry(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|entry| entry.name == name)
    }

    /// A 64-bit FNV-1a hash of the canonical architecture description: a format tag, `obs_dim`,
    /// `n_actions`, the torso widths, the activation, the core, and every entry's name, shape
    /// and offset.
    ///
    /// It is hand-written over explicit little-endian bytes, so it is the same on every platform,
    /// build and Rust version; weights published under one hash can only be loaded by a process
    /// whose layout has the same hash.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// The action head.
    pub fn head(&self) -> ActionHead {
        self.spec.head
    }

    /// Where the Gaussian head's state-independent log-std vector (`A` values) sits in the flat
    /// buffer, or `None` for a categorical head.
    pub fn log_std_range(&self) -> Option<Range<usize>> {
        self.log_std.map(|offset| offset..offset + self.spec.n_actions)
    }

    /// The geometry of each conv layer, input side first (empty without a conv torso).
    pub fn conv_geometries(&self) -> &[ConvGeometry] {
        &self.conv_geometries
    }

    /// Where the observation statistics `[mean (obs_dim), var (obs_dim), count]` sit in the
    /// flat buffer, or `None` without observation normalisation ([`crate::obs_norm`]).
    pub fn obs_norm_range(&self) -> Option<Range<usize>> {
        self.obs_norm.map(|offset| offset..offset + crate::obs_norm::stats_len(self.spec.obs_dim))
    }

    /// Recurrent state size per agent: 0 for [`CoreKind::Mlp`], `hidden` for [`CoreKind::Gru`].
    pub fn recurrent_size(&self) -> usize {
        self.gru.map_or(0, |gru| gru.hidden)
    }

    /// Width of the feature vector the heads read (last torso width, GRU hidden size, or
    /// `obs_dim` for a linear policy).
    pub fn feature_dim(&self) -> usize {
        self.heads.n_in
    }

    /// Fresh parameters: cleanrl-style orthogonal weights (see the table on [`ParamLayout`]) and
    /// zero biases, drawn from a PCG-64 stream seeded with `seed`. The same seed gives the same
    /// bits on a given platform (the Gaussian draws go through libm's `ln`/`cos` in `f64`, whose
    /// last-ulp differences across platforms almost never survive rounding to `f32`).
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        super::init::init_params(self, seed)
    }

    pub(crate) fn init_rules(&self) -> &[InitRule] {
        &self.init_rules
    }

    /// The conv layers' weights (`[OC][C·K·K]`, as `n_out × n_in`) and biases.
    pub(crate) fn conv(&self) -> &[DenseOffsets] {
        &self.conv
    }

    /// The width the dense torso reads: the last conv layer's `OH·OW·OC`, else `obs_dim`.
    pub(crate) fn torso_input_dim(&self) -> usize {
        self.conv_geometries.last().map_or(self.spec.obs_dim, |g| g.output_len())
    }

    pub(crate) fn torso(&self) -> &[DenseOffsets] {
        &self.torso
    }

    pub(crate) fn gru(&self) -> Option<GruOffsets> {
        self.gru
    }

    /// The policy head with the value head fused in as its last row (`n_out = n_actions + 1`),
    /// or, with a separate value network, the policy head alone (`n_out = n_actions`).
    pub(crate) fn heads(&self) -> DenseOffsets {
        self.heads
    }

    /// The separate value network's layers (empty without one).
    pub(crate) fn critic(&self) -> &[DenseOffsets] {
        &self.critic
    }

    /// The value head over the separate value network's features, or `None` when the value
    /// head is fused into [`heads`](Self::heads).
    pub(crate) fn value_head(&self) -> Option<DenseOffsets> {
        self.value
    }

    pub(crate) fn n_actions(&self) -> usize {
        self.spec.n_actions
    }

    pub(crate) fn obs_dim(&self) -> usize {
        self.spec.obs_dim
    }

    /// The widest torso layer (0 when the torso is empty).
    pub(crate) fn max_torso_width(&self) -> usize {
        self.spec.torso.iter().copied().max().unwrap_or(0)
    }

    fn compute_hash(&self) -> u64 {
        let mut hasher = Fnv1a::new();
        hasher.write_str("volley.policy.layout.v1");
        hasher.write_u64(self.spec.obs_dim as u64);
        hasher.write_u64(self.spec.n_actions as u64);
        hasher.write_u64(self.spec.torso.len() as u64);
        for &width in &self.spec.torso {
            hasher.write_u64(width as u64);
        }
        hasher.write_str(self.spec.activation.name());
        match self.spec.core {
            CoreKind::Mlp => hasher.write_str("mlp"),
            CoreKind::Gru { hidden } => {
                hasher.write_str("gru");
                hasher.write_u64(hidden as u64);
            }
        }
        // Categorical layouts hash as they did before heads existed, so their weights and
        // checkpoints still load.
        if let ActionHead::Gaussian { squash } = self.spec.head {
            hasher.write_str(if squash { "gaussian-tanh" } else { "gaussian" });
        }
        // Written only when present, so the hashes of specs without a conv torso are unchanged.
        if let Some(conv) = &self.spec.conv {
            hasher.write_str("conv");
            for value in [conv.in_channels, conv.height, conv.width, conv.layers.len()] {
                hasher.write_u64(value as u64);
            }
            for layer in &conv.layers {
                for value in [layer.out_channels, layer.kernel, layer.stride, layer.padding] {
                    hasher.write_u64(value as u64);
                }
            }
        }
        if self.spec.normalize_obs {
            hasher.write_str("obs-norm");
        }
        if !self.spec.critic.is_empty() {
            hasher.write_str("critic");
            hasher.write_u64(self.spec.critic.len() as u64);
            for &width in &self.spec.critic {
                hasher.write_u64(width as u64);
            }
        }
        hasher.write_u64(self.entries.len() as u64);
        for entry in &self.entries {
            hasher.write_str(&entry.name);
            hasher.write_u64(entry.offset as u64);
            hasher.write_u64(entry.rows as u64);
            hasher.write_u64(entry.cols as u64);
        }
        hasher.finish()
    }
}

#[derive(Default)]
struct Builder {
    entries: Vec<ParamEntry>,
    init_rules: Vec<InitRule>,
    n_params: usize,
}

impl Builder {
    /// Append a stack of dense layers named `{name}.{i}.weight` / `{name}.{i}.bias` of the given
    /// widths over `n_in` inputs (orthogonal weights with ReLU/tanh gain √2, zero biases).
    fn push_dense_stack(&mut self, name: &str, widths: &[usize], mut n_in: usize) -> Vec<DenseOffsets> {
        let gain = std::f32::consts::SQRT_2;
        let mut layers = Vec::with_capacity(widths.len());
        for (layer_idx, &n_out) in widths.iter().enumerate() {
            let weight =
                self.push(format!("{name}.{layer_idx}.weight"), n_out, n_in, InitRule::Orthogonal { gain, blocks: 1 });
            let bias = self.push(format!("{name}.{layer_idx}.bias"), 1, n_out, InitRule::Zeros);
            layers.push(DenseOffsets { weight, bias, n_in, n_out });
            n_in = n_out;
        }
        layers
    }

    /// Append a `rows × cols` block and return its offset.
    fn push(&mut self, name: String, rows: usize, cols: usize, init: InitRule) -> usize {
        let offset = self.n_params;
        self.entries.push(ParamEntry { name, offset, rows, cols });
        self.init_rules.push(init);
        self.n_params += rows * cols;
        offset
    }
}

impl ParamLayout {
    /// The factor the network applies to every observation value before its first layer: 1,
    /// or 1/255 for a conv torso that reads 8-bit pixels ([`crate::ConvInput::Pixels`]).
    /// Actors' inference and the learner's batch staging both apply it, so observations stay
    /// whole pixel values in memory and one byte each on the wire.
    pub fn input_scale(&self) -> f32 {
        self.spec().conv.as_ref().map_or(1.0, |conv| conv.input.scale())
    }
}

fn validate(spec: &PolicySpec) -> Result<(), PolicyError> {
    const WIDTH_RULE: &str = "between 1 and 65536";
    fn check_width(field: impl Into<String>, value: usize) -> Result<(), PolicyError> {
        if (1..=MAX_LAYER_WIDTH).contains(&value) {
            Ok(())
        } else {
            Err(PolicyError::InvalidSpec { field: field.into(), value, rule: WIDTH_RULE })
        }
    }
    check_width("obs_dim", spec.obs_dim)?;
    check_width("n_actions", spec.n_actions)?;
    if spec.normalize_obs && spec.conv.as_ref().is_some_and(|conv| conv.input != crate::ConvInput::Raw) {
        return Err(PolicyError::InvalidSpec {
            field: "normalize_obs".into(),
            value: 1,
            rule: "off for a conv torso that scales pixels (conv.input = pixels)",
        });
    }
    for (name, widths) in [("torso", &spec.torso), ("critic", &spec.critic)] {
        if widths.len() > MAX_TORSO_LAYERS {
            return Err(PolicyError::InvalidSpec {
                field: format!("{name}.len()"),
                value: widths.len(),
                rule: "at most 64",
            });
        }
        for (layer_idx, &width) in widths.iter().enumerate() {
            check_width(format!("{name}[{layer_idx}]"), width)?;
        }
    }
    if let CoreKind::Gru { hidden } = spec.core {
        check_width("core.hidden", hidden)?;
    }
    if !spec.critic.is_empty() && (spec.conv.is_some() || spec.core != CoreKind::Mlp) {
        return Err(PolicyError::InvalidSpec {
            field: "critic.len()".into(),
            value: spec.critic.len(),
            rule: "0 with a conv torso or a recurrent core (a separate value network reads vector \
                   observations and has no memory)",
        });
    }
    // Widths are at most 2¹⁶ and there are at most 64 layers, so every product below fits in
    // u64; saturate anyway so the check cannot be defeated by a future limit change.
    let mut n_params: u64 = 0;
    let mut n_in = spec.obs_dim as u64;
    let mut add_dense = |n_in: u64, n_out: u64| {
        n_params = n_params.saturating_add(n_out.saturating_mul(n_in.saturating_add(1)));
    };
    if let Some(conv) = &spec.conv {
        if conv.input_dim() != spec.obs_dim {
            return Err(PolicyError::InvalidSpec {
                field: "obs_dim".into(),
                value: spec.obs_dim,
                rule: "equal to the conv input's channels × height × width",
            });
        }
        for geometry in conv.geometries()? {
            add_dense(geometry.patch_len() as u64, geometry.out_channels as u64);
            n_in = geometry.output_len() as u64;
        }
    }
    for &width in &spec.torso {
        add_dense(n_in, width as u64);
        n_in = width as u64;
    }
    if let CoreKind::Gru { hidden } = spec.core {
        let hidden = hidden as u64;
        add_dense(n_in, 3 * hidden);
        add_dense(hidden, 3 * hidden);
        n_in = hidden;
    }
    if spec.critic.is_empty() {
        add_dense(n_in, spec.n_actions as u64 + 1);
    } else {
        add_dense(n_in, spec.n_actions as u64);
        let mut value_in = spec.obs_dim as u64;
        for &width in &spec.critic {
            add_dense(value_in, width as u64);
            value_in = width as u64;
        }
        add_dense(value_in, 1);
    }
    if spec.head.is_continuous() {
        n_params = n_params.saturating_add(spec.n_actions as u64);
    }
    if spec.normalize_obs {
        n_params = n_params.saturating_add(2 * spec.obs_dim as u64 + 1);
    }
    if n_params > MAX_PARAMS as u64 {
        return Err(PolicyError::TooManyParams { n_params, max: MAX_PARAMS });
    }
    Ok(())
}

/// 64-bit FNV-1a (Fowler–Noll–Vo), written out so the value never depends on std's hasher.
struct Fnv1a(u64);

impl Fnv1a {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn new() -> Self {
        Fnv1a(Self::OFFSET_BASIS)
    }

    fn write_bytes(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.write_bytes(&value.to_le_bytes());
    }

    /// Length-prefixed, so `("ab", "c")` and `("a", "bc")` hash differently.
    fn write_str(&mut self, value: &str) {
        self.write_u64(value.len() as u64);
        self.write_bytes(value.as_bytes());
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::Activation;
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn cartpole_mlp() -> PolicySpec {
        PolicySpec::mlp(4, 2, &[64, 64], Activation::Tanh)
    }

    #[test]
    fn fnv1a_matches_reference_vectors() {
        // Reference values from the FNV specification's test suite.
        let mut hasher = Fnv1a::new();
        assert_eq!(hasher.finish(), 0xcbf2_9ce4_8422_2325);
        hasher.write_bytes(b"a");
        assert_eq!(hasher.finish(), 0xaf63_dc4c_8601_ec8c);
        let mut hasher = Fnv1a::new();
        hasher.write_bytes(b"foobar");
        assert_eq!(hasher.finish(), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn layout_hash_of_cartpole_mlp_is_golden() {
        // Changing this value means published weights and checkpoints no longer load: bump the
        // format tag in `compute_hash` deliberately if the layout really has to change.
        let layout = ParamLayout::new(&cartpole_mlp()).unwrap();
        assert_eq!(layout.hash(), 11_684_108_682_957_078_939);
        let gru = ParamLayout::new(&PolicySpec::gru(4, 2, &[64], Activation::Relu, 32)).unwrap();
        assert_eq!(gru.hash(), 3_160_628_195_615_717_663);
    }

    #[test]
    fn layout_hash_differs_for_every_spec_change() {
        let base = cartpole_mlp();
        let mut variants = vec![base.clone()];
        let mut push = |edit: &dyn Fn(&mut PolicySpec)| {
            let mut spec = base.clone();
            edit(&mut spec);
            variants.push(spec);
        };
        push(&|s| s.obs_dim = 5);
        push(&|s| s.n_actions = 3);
        push(&|s| s.torso = vec![64]);
        push(&|s| s.torso = vec![64, 64, 64]);
        push(&|s| s.torso = vec![64, 32]);
        push(&|s| s.torso = vec![32, 64]);
        push(&|s| s.torso = vec![]);
        push(&|s| s.activation = Activation::Relu);
        push(&|s| s.core = CoreKind::Gru { hidden: 64 });
        push(&|s| s.core = CoreKind::Gru { hidden: 32 });
        push(&|s| s.head = ActionHead::Gaussian { squash: false });
        push(&|s| s.head = ActionHead::Gaussian { squash: true });
        push(&|s| s.normalize_obs = true);
        push(&|s| s.critic = vec![64, 64]);
        push(&|s| s.critic = vec![64]);
        push(&|s| s.critic = vec![32, 64]);
        push(&|s| {
            s.torso = vec![];
            s.core = CoreKind::Gru { hidden: 64 };
        });
        // Same parameter count as the base (4·64+64 + 64·64+64 + 3·64+3) is not enough to collide.
        push(&|s| {
            s.obs_dim = 64;
            s.torso = vec![4, 64];
        });
        let hashes: HashSet<u64> = variants.iter().map(|spec| ParamLayout::new(spec).unwrap().hash()).collect();
        assert_eq!(hashes.len(), variants.len(), "two specs share a layout hash");
    }

    /// Each entry's `(name, offset, rows, cols)`, in buffer order.
    fn summary(layout: &ParamLayout) -> Vec<(&str, usize, usize, usize)> {
        layout.entries().iter().map(|e| (e.name.as_str(), e.offset, e.rows, e.cols)).collect()
    }

    #[test]
    fn cartpole_mlp_entries_have_documented_names_shapes_and_offsets() {
        let layout = ParamLayout::new(&cartpole_mlp()).unwrap();
        assert_eq!(
            summary(&layout),
            [
                ("torso.0.weight", 0, 64, 4),
                ("torso.0.bias", 256, 1, 64),
                ("torso.1.weight", 320, 64, 64),
                ("torso.1.bias", 4416, 1, 64),
                ("policy.weight", 4480, 2, 64),
                ("value.weight", 4608, 1, 64),
                ("policy.bias", 4672, 1, 2),
                ("value.bias", 4674, 1, 1),
            ]
        );
        assert_eq!(layout.n_params(), 4675);
        assert_eq!(layout.recurrent_size(), 0);
        assert_eq!(layout.feature_dim(), 64);
    }

    #[test]
    fn a_separate_value_network_gets_its_own_layers_and_a_value_head_on_them() {
        let layout = ParamLayout::new(&cartpole_mlp().with_critic(&[32, 16])).unwrap();
        let shared = ParamLayout::new(&cartpole_mlp()).unwrap();
        // The torso is laid out as without a value network, and the value network follows it.
        assert_eq!(summary(&layout)[..4], summary(&shared)[..4]);
        assert_eq!(
            summary(&layout)[4..],
            [
                ("critic.0.weight", 4480, 32, 4),
                ("critic.0.bias", 4608, 1, 32),
                ("critic.1.weight", 4640, 16, 32),
                ("critic.1.bias", 5152, 1, 16),
                ("policy.weight", 5168, 2, 64),
                ("value.weight", 5296, 1, 16),
                ("policy.bias", 5312, 1, 2),
                ("value.bias", 5314, 1, 1),
            ]
        );
        assert_eq!(layout.n_params(), 5315);
        assert_eq!(layout.feature_dim(), 64);
        assert_eq!(layout.heads().n_out, 2, "the policy head alone");
        let value = layout.value_head().unwrap();
        assert_eq!((value.weight, value.bias, value.n_in, value.n_out), (5296, 5314, 16, 1));
        // Without one, the value head stays fused into the policy head's product.
        assert_eq!((shared.heads().n_out, shared.value_head(), shared.critic().len()), (3, None, 0));
    }

    #[test]
    fn gru_layout_has_gate_stacked_entries() {
        let layout = ParamLayout::new(&PolicySpec::gru(3, 5, &[], Activation::Tanh, 7)).unwrap();
        let shape = |name: &str| {
            let e = layout.entry(name).unwrap();
            (e.rows, e.cols)
        };
        assert_eq!(shape("gru.weight_ih"), (21, 3));
        assert_eq!(shape("gru.weight_hh"), (21, 7));
        assert_eq!(shape("gru.bias_ih"), (1, 21));
        assert_eq!(shape("gru.bias_hh"), (1, 21));
        assert_eq!(shape("policy.weight"), (5, 7));
        assert_eq!(shape("value.weight"), (1, 7));
        assert_eq!(layout.recurrent_size(), 7);
        assert_eq!(layout.feature_dim(), 7);
    }

    #[test]
    fn conv_torso_entries_come_first_and_change_the_hash() {
        let spec = PolicySpec::mlp(0, 6, &[128], Activation::Relu).with_conv(crate::ConvSpec::minatar(4, 10, 10));
        assert_eq!(spec.obs_dim, 400);
        let layout = ParamLayout::new(&spec).unwrap();
        // 16 filters of 4·3·3, then the dense layer over the 8·8·16 = 1024 conv outputs.
        assert_eq!(
            summary(&layout)[..4],
            [
                ("conv.0.weight", 0, 16, 36),
                ("conv.0.bias", 576, 1, 16),
                ("torso.0.weight", 592, 128, 1024),
                ("torso.0.bias", 592 + 128 * 1024, 1, 128)
            ]
        );
        assert_eq!(layout.conv_geometries().len(), 1);
        let mut stride_2 = spec.clone();
        stride_2.conv.as_mut().unwrap().layers[0].stride = 2;
        let hashes: HashSet<u64> =
            [cartpole_mlp(), spec.clone(), stride_2].iter().map(|s| ParamLayout::new(s).unwrap().hash()).collect();
        assert_eq!(hashes.len(), 3);
        let mut mismatched = spec;
        mismatched.obs_dim = 401;
        let err = ParamLayout::new(&mismatched).unwrap_err().to_string();
        assert!(err.contains("obs_dim") && err.contains("conv"), "{err}");
    }

    #[test]
    fn invalid_specs_are_errors_not_panics() {
        let zero_obs = PolicySpec::mlp(0, 2, &[8], Activation::Tanh);
        assert!(matches!(
            ParamLayout::new(&zero_obs),
            Err(PolicyError::InvalidSpec { ref field, value: 0, .. }) if field == "obs_dim"
        ));
        let zero_actions = PolicySpec::mlp(4, 0, &[8], Activation::Tanh);
        assert!(ParamLayout::new(&zero_actions).is_err());
        let zero_width = PolicySpec::mlp(4, 2, &[8, 0], Activation::Tanh);
        assert!(matches!(
            ParamLayout::new(&zero_width),
            Err(PolicyError::InvalidSpec { ref field, .. }) if field == "torso[1]"
        ));
        let zero_hidden = PolicySpec::gru(4, 2, &[8], Activation::Tanh, 0);
        assert!(ParamLayout::new(&zero_hidden).is_err());
        let huge_width = PolicySpec::mlp(4, 2, &[usize::MAX], Activation::Tanh);
        assert!(ParamLayout::new(&huge_width).is_err());
        let huge_hidden = PolicySpec::gru(4, 2, &[], Activation::Tanh, usize::MAX / 2);
        assert!(ParamLayout::new(&huge_hidden).is_err());
        let too_deep = PolicySpec::mlp(4, 2, &[2; MAX_TORSO_LAYERS + 1], Activation::Tanh);
        assert!(ParamLayout::new(&too_deep).is_err());
        let zero_critic = PolicySpec::mlp(4, 2, &[8], Activation::Tanh).with_critic(&[8, 0]);
        assert!(matches!(
            ParamLayout::new(&zero_critic),
            Err(PolicyError::InvalidSpec { ref field, .. }) if field == "critic[1]"
        ));
        let deep_critic = PolicySpec::mlp(4, 2, &[8], Activation::Tanh).with_critic(&[2; MAX_TORSO_LAYERS + 1]);
        assert!(ParamLayout::new(&deep_critic).is_err());
        let recurrent_critic = PolicySpec::gru(4, 2, &[8], Activation::Tanh, 4).with_critic(&[8]);
        let err = ParamLayout::new(&recurrent_critic).unwrap_err().to_string();
        assert!(err.contains("critic") && err.contains("recurrent core"), "{err}");
        let conv_critic = PolicySpec::mlp(0, 6, &[128], Activation::Relu)
            .with_conv(crate::ConvSpec::minatar(4, 10, 10))
            .with_critic(&[8]);
        assert!(ParamLayout::new(&conv_critic).is_err());
        let huge_critic = PolicySpec::mlp(4, 2, &[8], Activation::Tanh).with_critic(&[MAX_LAYER_WIDTH; 4]);
        assert!(matches!(ParamLayout::new(&huge_critic), Err(PolicyError::TooManyParams { .. })));
        let too_many = PolicySpec::mlp(4, 2, &[MAX_LAYER_WIDTH; 4], Activation::Tanh);
        let err = ParamLayout::new(&too_many).unwrap_err();
        assert!(matches!(err, PolicyError::TooManyParams { .. }));
        assert!(err.to_string().contains("parameters exceed the limit"));
    }

    #[test]
    fn spec_serializes_with_lowercase_names() {
        let spec = PolicySpec::gru(4, 2, &[64], Activation::Tanh, 16);
        let config = bincode::config::standard();
        let bytes = bincode::serde::encode_to_vec(&spec, config).unwrap();
        let (decoded, _): (PolicySpec, usize) = bincode::serde::decode_from_slice(&bytes, config).unwrap();
        assert_eq!(decoded, spec);
    }

    /// Random MLP and GRU specs with categorical heads: fewer than `max_obs` observations and
    /// `max_actions` actions, fewer than `max_layers` torso layers of fewer than `max_width`
    /// units, tanh or ReLU, and a GRU core of fewer than `max_hidden` units or none; without a
    /// GRU, a separate value network of up to `max_layers − 1` such layers or none.
    pub(crate) fn arb_spec(
        max_obs: usize,
        max_actions: usize,
        max_width: usize,
        max_layers: usize,
        max_hidden: usize,
    ) -> impl Strategy<Value = PolicySpec> {
        let torso = prop::collection::vec(1..max_width, 0..max_layers);
        let critic = prop::collection::vec(1..max_width, 0..max_layers);
        (1..max_obs, 1..max_actions, torso, prop::bool::ANY, prop::option::of(1..max_hidden), critic).prop_map(
            |(obs_dim, n_actions, torso, relu, hidden, critic)| PolicySpec {
                obs_dim,
                n_actions,
                torso,
                activation: if relu { Activation::Relu } else { Activation::Tanh },
                core: hidden.map_or(CoreKind::Mlp, |hidden| CoreKind::Gru { hidden }),
                head: super::super::ActionHead::Categorical,
                conv: None,
                normalize_obs: false,
                critic: if hidden.is_some() { Vec::new() } else { critic },
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn entries_tile_the_buffer_without_gaps_or_overlap(spec in arb_spec(20, 8, 20, 4, 16)) {
            let layout = ParamLayout::new(&spec).unwrap();
            let mut next = 0;
            for entry in layout.entries() {
                prop_assert_eq!(entry.offset, next);
                prop_assert!(entry.n_elements() > 0);
                next = entry.range().end;
            }
            prop_assert_eq!(next, layout.n_params());
            // The fused head invariant: value rows follow policy rows, value bias follows policy bias.
            let policy_w = layout.entry("policy.weight").unwrap();
            let value_w = layout.entry("value.weight").unwrap();
            prop_assert_eq!(policy_w.range().end, value_w.offset);
            let policy_b = layout.entry("policy.bias").unwrap();
            let value_b = layout.entry("value.bias").unwrap();
            prop_assert_eq!(policy_b.range().end, value_b.offset);
        }

        #[test]
        fn layout_is_a_pure_function_of_the_spec(spec in arb_spec(20, 8, 20, 4, 16)) {
            let a = ParamLayout::new(&spec).unwrap();
            let b = ParamLayout::new(&spec.clone()).unwrap();
            prop_assert_eq!(a.hash(), b.hash());
            prop_assert_eq!(a, b);
        }
    }
}
