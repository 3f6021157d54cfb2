//! Finding and loading `libnixl_capi.so`: where it is when no path is given, and its function
//! table, loaded once per path for the life of the process.
//!
//! The `nixl-cu12` wheel puts it in `site-packages/.nixl_cu12.mesonpy.libs/` (beside its
//! `plugins/` folder, with the bundled UCX in `site-packages/nixl_cu12.libs/`); every library
//! there has an `$ORIGIN` RPATH, so loading it by absolute path needs no environment variable.
//!
//! Order: the project-local venv `.venv-nixl/` (made by `scripts/install-nixl`), looked for in
//! the current directory and its ancestors, then in the executable's ancestors; then wherever
//! `python3` has the `nixl_cu12` package installed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{sys, NixlConfig, BACKEND};
use crate::TransportError;

/// The library's file name.
pub const LIB_NAME: &str = "libnixl_capi.so";
/// The project-local venv `scripts/install-nixl` creates.
pub const VENV_DIR: &str = ".venv-nixl";

/// Folders of a `site-packages` that may hold the library, most likely first.
const SITE_SUBDIRS: &[&str] = &[
    ".nixl_cu12.mesonpy.libs",
    "nixl_cu12",
    ".nixl.mesonpy.libs",
    "nixl",
];

/// Where the library is, or one line saying what was looked for.
fn search(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!(
                "{} does not exist (from HANDOFF_NIXL_LIB or the config); run scripts/install-nixl or fix the path",
                p.display()
            ))
        };
    }
    for base in search_bases() {
        if let Some(lib) = in_venv(&base.join(VENV_DIR)) {
            return Ok(lib);
        }
    }
    if let Some(lib) = from_python() {
        return Ok(lib);
    }
    Err(format!(
        "{LIB_NAME} not found (HANDOFF_NIXL_LIB unset, no {VENV_DIR}/ in the current directory, its parents or the executable's, no nixl_cu12 package for python3); run scripts/install-nixl (or pip install nixl-cu12) or set HANDOFF_NIXL_LIB=/path/to/{LIB_NAME}"
    ))
}

/// The current directory and its ancestors, then the executable's ancestors, without repeats.
fn search_bases() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let mut push_ancestors = |start: &Path| {
        for a in start.ancestors() {
            if !out.iter().any(|p| p == a) {
                out.push(a.to_path_buf());
            }
        }
    };
    if let Ok(cwd) = std::env::current_dir() {
        push_ancestors(&cwd);
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            push_ancestors(dir);
        }
    }
    out
}

/// `<venv>/lib/python3*/site-packages/<subdir>/libnixl_capi.so`.
fn in_venv(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    let mut pythons: Vec<PathBuf> = std::fs::read_dir(&lib)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path())
        .collect();
    pythons.sort();
    pythons
        .iter()
        .rev()
        .find_map(|py| in_site_packages(&py.join("site-packages")))
}

fn in_site_packages(site: &Path) -> Option<PathBuf> {
    SITE_SUBDIRS
        .iter()
        .map(|d| site.join(d).join(LIB_NAME))
        .find(|p| p.is_file())
}

/// Asks `python3` where the `nixl_cu12` package is (without importing it), bounded in time.
fn from_python() -> Option<PathBuf> {
    let script = "import importlib.util as u\n\
                  s = u.find_spec('nixl_cu12')\n\
                  print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')";
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
    let out = child.wait_with_output().ok()?;
    let pkg = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if pkg.is_empty() {
        return None;
    }
    let pkg = PathBuf::from(pkg);
    in_site_packages(pkg.parent()?)
}

/// Where `libnixl_capi.so` is for `cfg`: `cfg.lib_path` if set; else `.venv-nixl/` in the
/// current directory or one of its ancestors, then in one of the executable's ancestors; else
/// the `nixl_cu12` package `python3` knows. The error is [`TransportError::Unavailable`] with one
/// line saying what was looked for and how to install.
pub fn locate(cfg: &NixlConfig) -> Result<PathBuf, TransportError> {
    search(cfg.lib_path.as_deref()).map_err(unavailable)
}

pub(super) fn unavailable(reason: String) -> TransportError {
    TransportError::Unavailable {
        backend: BACKEND,
        reason: reason.split_whitespace().collect::<Vec<_>>().join(" "),
    }
}

/// Loads (once per path, for the life of the process) the function table of `path`.
///
/// Libraries are never unloaded: NIXL and UCX keep threads and static destructors that must not
/// outlive their code.
pub(super) fn load_api(path: &Path) -> Result<&'static sys::Api, TransportError> {
    static LOADED: OnceLock<Mutex<Vec<(PathBuf, &'static sys::Api)>>> = OnceLock::new();
    let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mut loaded = LOADED
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some((_, api)) = loaded.iter().find(|(p, _)| *p == key) {
        return Ok(api);
    }
    if key.file_name().and_then(|n| n.to_str()) != Some(LIB_NAME) {
        return Err(unavailable(format!(
            "{} is not {LIB_NAME}; set HANDOFF_NIXL_LIB to NIXL's C API library",
            key.display()
        )));
    }
    // SAFETY: the file is named libnixl_capi.so and was chosen as NIXL's C API library by the
    // user or by [`search`]; every symbol is then resolved by name and checked present.
    let api = unsafe { sys::Api::load(&key) }
        .map_err(|e| unavailable(format!("cannot load {}: {e}", key.display())))?;
    // SAFETY: `is_stub` takes no arguments and only returns a flag.
    if unsafe { (api.is_stub)() } {
        return Err(unavailable(format!(
            "{} is the nixl-sys stub library, not NIXL; run scripts/install-nixl",
            key.display()
        )));
    }
    let api: &'static sys::Api = Box::leak(Box::new(api));
    loaded.push((key, api));
    Ok(api)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nixl_missing_explicit_path_is_one_line() {
        let err = search(Some(Path::new("/nonexistent/libnixl_capi.so"))).unwrap_err();
        assert!(!err.contains('\n'));
        assert!(err.contains("/nonexistent/libnixl_capi.so"));
    }

    #[test]
    fn nixl_search_bases_start_at_cwd() {
        let bases = search_bases();
        assert_eq!(bases[0], std::env::current_dir().unwrap());
        assert!(bases.iter().any(|b| b == Path::new("/")));
    }
}
