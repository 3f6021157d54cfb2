//! `handoff engine`: flags over environment over a TOML file over defaults.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use handoff_engine::EngineConfig;

#[derive(Args, Debug, Clone, Default)]
pub struct EngineArgs {
    /// prefill, decode or both.
    #[arg(long)]
    pub role: Option<String>,
    /// TOML file with any engine field (docs/src/reference/engine-settings.md).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address every listener binds (HTTP, side channel, tcp transport).
    #[arg(long)]
    pub host: Option<String>,
    /// Address peers dial (default: --host; required when --host is 0.0.0.0 or ::).
    #[arg(long)]
    pub advertise_host: Option<String>,
    #[arg(long)]
    pub port: Option<u16>,
    #[arg(long)]
    pub engine_id: Option<String>,
    #[arg(long)]
    pub num_blocks: Option<u32>,
    #[arg(long)]
    pub block_size: Option<u32>,
    #[arg(long)]
    pub tp: Option<u32>,
    /// layers-outermost (default: a descriptor per layer for a contiguous run), blocks-outermost
    /// or heads-outermost (for P/D pairs of different TP or block size: descriptors then do not
    /// grow with the prompt).
    #[arg(long)]
    pub kv_pool_layout: Option<String>,
    /// tcp or nixl.
    #[arg(long)]
    pub transport: Option<String>,
    /// pull or push.
    #[arg(long)]
    pub mode: Option<String>,
    /// Any other field: `--set decode_step_ms=5` (repeatable).
    #[arg(long = "set", value_name = "FIELD=VALUE")]
    pub set: Vec<String>,
}

impl EngineArgs {
    pub fn resolve(&self) -> anyhow::Result<EngineConfig> {
        let mut cfg = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                EngineConfig::from_toml(&text).with_context(|| format!("in {}", path.display()))?
            }
            None => EngineConfig::default(),
        };
        cfg.apply_env(std::env::vars())?;
        let mut overrides: Vec<(String, String)> = Vec::new();
        let mut put = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                overrides.push((format!("HANDOFF_{}", k.to_ascii_uppercase()), v));
            }
        };
        put("role", self.role.clone());
        put("host", self.host.clone());
        put("advertise_host", self.advertise_host.clone());
        put("port", self.port.map(|x| x.to_string()));
        put("engine_id", self.engine_id.clone());
        put("num_blocks", self.num_blocks.map(|x| x.to_string()));
        put("block_size", self.block_size.map(|x| x.to_string()));
        put("tp", self.tp.map(|x| x.to_string()));
        put("kv_pool_layout", self.kv_pool_layout.clone());
        put("transport", self.transport.clone());
        put("mode", self.mode.clone());
        for kv in &self.set {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("--set {kv:?}: expected FIELD=VALUE"))?;
            if !toml_has_field(k) {
                anyhow::bail!("--set {kv:?}: no engine field named `{k}`");
            }
            overrides.push((format!("HANDOFF_{}", k.to_ascii_uppercase()), v.to_string()));
        }
        cfg.apply_env(overrides.into_iter())?;
        cfg.validate()?;
        Ok(cfg)
    }
}

fn toml_has_field(k: &str) -> bool {
    toml_fields().iter().any(|f| f == k)
}

fn toml_fields() -> Vec<String> {
    let v = serde_json::to_value(EngineConfig::default()).unwrap_or_default();
    v.as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}
