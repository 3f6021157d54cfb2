//! How NIXL is loaded and configured: the library's path, the progress thread's delay, the
//! backend and its parameters (from the environment or set in code), and how a post is spread
//! over the UCX backend's thread pool. No NIXL call here.

use std::path::PathBuf;

/// How to load and configure NIXL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlConfig {
    /// `libnixl_capi.so`; `None` searches for it (see [`locate`]).
    pub lib_path: Option<PathBuf>,
    /// Sleep of each agent's progress thread between polls, in µs (NIXL's `pthr_delay_us`).
    pub progress_delay_us: u64,
    /// NIXL backend plugin, `"UCX"` by default.
    pub backend: String,
    /// Backend parameters passed to `create_backend` (`key`, `value`); by default
    /// [`UCX_DEFAULT_PARAMS`].
    pub backend_params: Vec<(String, String)>,
}

/// The UCX backend's parameters unless configured otherwise: two worker threads, and a
/// transfer of 128 descriptors or more (two parts of at least 64) split between them; a
/// transfer of fewer, large descriptors is cut to that count first ([`Spread`]).
///
/// Why: between processes of one host UCX copies with CMA (`process_vm_readv`) on the thread
/// that posts, so one transfer moves at one core's copy speed, about half of a memcpy
/// (NIXL's C API header, `nixl_capi.h`). NIXL's UCX thread pool (`num_threads`) posts the halves of a
/// transfer from its own threads at once: on 2 cores a 256 MiB transfer of 64 KiB blocks went
/// from about 4 to about 6.5 GB/s, and 1 MiB blocks from about 5 to about 7.8 GB/s. NIXL's own
/// split threshold (`split_batch_size`, 1024 descriptors) would leave a typical handoff (tens to
/// hundreds of descriptors) on one thread. Idle pool threads block; they do not spin.
pub const UCX_DEFAULT_PARAMS: [(&str, &str); 2] =
    [("num_threads", "2"), ("split_batch_size", "64")];

/// A descriptor as NIXL takes it: address and length.
type AddrLen = (usize, usize);

/// Smallest piece a descriptor is cut into to spread a post over the thread pool: below this the
/// cost per descriptor (and per thread hand-off) eats what the second core brings.
pub const MIN_SPREAD_PIECE: usize = 64 << 10;

/// Smallest post spread over the thread pool. A post the pool runs completes after the caller's
/// next status check, a poll tick later (the connector polls every millisecond), while one that
/// runs on the caller's worker is done when `post_xfer_req` returns. A few MiB copy in well under
/// that tick: a layer-wise pull's stages (one layer of a contiguous run, 8 MiB in `bench
/// transfer`'s model) moved at 0.18× bare NIXL spread, against ~1× inline.
pub const MIN_SPREAD_TOTAL: usize = 32 << 20;

/// How a post reaches every thread of the UCX backend's thread pool.
///
/// NIXL's UCX backend (1.5) runs a list of `n` descriptors on the caller's worker when
/// `n < split_batch_size`; otherwise it cuts it into parts of `max(n / num_threads,
/// split_batch_size)` descriptors, one per pool thread. A handoff between pools of equal shape
/// is often a few descriptors of many MiB (contiguous blocks coalesce), which would leave all
/// but one core idle: such a post is cut into `threads × batch` pieces first. Measured on
/// 2 cores, one 256 MiB descriptor went from about 5 to about 7 GB/s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spread {
    /// `num_threads` (at least 2, else there is nothing to spread over).
    pub threads: usize,
    /// `split_batch_size` (NIXL's default 1024 when not set).
    pub batch: usize,
}

impl Spread {
    /// The spread of the UCX backend configured by `cfg`, if it runs two pool threads or more.
    pub fn of(cfg: &NixlConfig) -> Option<Spread> {
        if cfg.backend != "UCX" {
            return None;
        }
        let param = |key: &str, default: usize| {
            cfg.backend_params
                .iter()
                .find(|(k, _)| k == key)
                .map_or(Some(default), |(_, v)| v.trim().parse().ok())
        };
        let threads = param("num_threads", 0)?;
        let batch = param("split_batch_size", 1024)?.max(1);
        (threads >= 2).then_some(Spread { threads, batch })
    }

    /// Descriptors a list needs for every pool thread to get a part.
    pub fn wanted(&self) -> usize {
        self.threads.saturating_mul(self.batch)
    }

    /// `local` and `remote` (address, length) pairs cut into at least [`Spread::wanted`] pieces
    /// of equal length (the last of each descriptor shorter), or `None` when the list is long
    /// enough already, the post is under [`MIN_SPREAD_TOTAL`] or pieces would be shorter than
    /// [`MIN_SPREAD_PIECE`]. Pieces keep their
    /// order and cover exactly the same bytes.
    pub fn cut(
        &self,
        local: &[AddrLen],
        remote: &[AddrLen],
    ) -> Option<(Vec<AddrLen>, Vec<AddrLen>)> {
        let wanted = self.wanted();
        if local.len() >= wanted {
            return None;
        }
        let total: usize = local.iter().map(|&(_, len)| len).sum();
        if total < MIN_SPREAD_TOTAL {
            return None;
        }
        // Whole pages, so pieces of page-aligned descriptors stay page-aligned.
        let piece = (total / wanted) & !4095;
        if piece < MIN_SPREAD_PIECE {
            return None;
        }
        let n = total.div_ceil(piece) + local.len();
        let (mut l, mut r) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (&(la, len), &(ra, _)) in local.iter().zip(remote) {
            let mut at = 0;
            while at < len {
                let k = piece.min(len - at);
                l.push((la + at, k));
                r.push((ra + at, k));
                at += k;
            }
        }
        Some((l, r))
    }
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig {
            lib_path: None,
            progress_delay_us: 100,
            backend: "UCX".to_string(),
            backend_params: UCX_DEFAULT_PARAMS
                .iter()
                .map(|&(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }
}

impl NixlConfig {
    /// Sets backend parameter `key` to `value`, replacing an earlier value of it.
    pub fn set_backend_param(&mut self, key: &str, value: &str) {
        match self.backend_params.iter_mut().find(|(k, _)| k == key) {
            Some(kv) => kv.1 = value.to_string(),
            None => self
                .backend_params
                .push((key.to_string(), value.to_string())),
        }
    }
}

impl NixlConfig {
    /// Defaults, overridden by `HANDOFF_NIXL_LIB` (path to `libnixl_capi.so`),
    /// `HANDOFF_NIXL_PROGRESS_DELAY_US`, `HANDOFF_NIXL_BACKEND` (another backend starts with no
    /// parameters) and `HANDOFF_NIXL_BACKEND_PARAMS` (`key=value,...`, each replacing the
    /// default of its key; `num_threads=0` turns UCX's thread pool off). A malformed delay or
    /// parameter list is ignored with a warning.
    pub fn from_env() -> Self {
        let mut cfg = NixlConfig::default();
        if let Some(p) = std::env::var_os("HANDOFF_NIXL_LIB").filter(|p| !p.is_empty()) {
            cfg.lib_path = Some(PathBuf::from(p));
        }
        if let Ok(v) = std::env::var("HANDOFF_NIXL_PROGRESS_DELAY_US") {
            match v.trim().parse() {
                Ok(d) => cfg.progress_delay_us = d,
                Err(_) => tracing::warn!(
                    "ignoring HANDOFF_NIXL_PROGRESS_DELAY_US={v:?} (not a number of µs)"
                ),
            }
        }
        if let Ok(b) = std::env::var("HANDOFF_NIXL_BACKEND") {
            if !b.trim().is_empty() && b.trim() != cfg.backend {
                cfg.backend = b.trim().to_string();
                cfg.backend_params.clear();
            }
        }
        if let Ok(v) = std::env::var("HANDOFF_NIXL_BACKEND_PARAMS") {
            match parse_backend_params(&v) {
                Ok(p) => {
                    for (k, v) in p {
                        cfg.set_backend_param(&k, &v);
                    }
                }
                Err(e) => tracing::warn!("ignoring HANDOFF_NIXL_BACKEND_PARAMS={v:?}: {e}"),
            }
        }
        cfg
    }
}

/// `key=value` pairs separated by commas (`num_threads=2,split_batch_size=512`), as given in
/// `HANDOFF_NIXL_BACKEND_PARAMS`.
pub fn parse_backend_params(s: &str) -> Result<Vec<(String, String)>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|kv| !kv.is_empty())
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                Ok((k.trim().to_string(), v.trim().to_string()))
            }
            _ => Err(format!("{kv:?} is not key=value")),
        })
        .collect()
}
