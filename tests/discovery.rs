//! Discovery and the `dmabuf-rt devices` table.

mod common;

use std::path::Path;
use std::process::Command;

use dmabuf_rt::discovery::{self, DrmNodeKind, NodeAccess};

#[test]
fn inventory_matches_the_filesystem() {
    let inv = discovery::discover();
    let heaps_on_disk: Vec<String> = std::fs::read_dir("/dev/dma_heap")
        .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let mut heaps_on_disk = heaps_on_disk;
    heaps_on_disk.sort();
    let found: Vec<String> =
        inv.heaps.iter().map(|h| h.path.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(found, heaps_on_disk);
    assert_eq!(inv.udmabuf.access == NodeAccess::Missing, !Path::new("/dev/udmabuf").exists());
    for d in &inv.drm {
        assert!(d.node.path.exists());
        let name = d.node.path.file_name().unwrap().to_string_lossy();
        assert_eq!(d.kind == DrmNodeKind::Render, name.starts_with("renderD"));
    }
    let table = inv.to_string();
    assert!(table.contains("/dev/udmabuf"), "{table}");
    for h in &inv.heaps {
        assert!(table.contains(&*h.path.to_string_lossy()), "{table}");
    }
}

#[test]
fn kernel_lane_sees_every_device() {
    // On a machine with the devices (the kernel lane), they must all be found and usable.
    let inv = discovery::discover();
    let have = inv.heaps.iter().any(|h| h.path.ends_with("system"))
        && inv.udmabuf.access != NodeAccess::Missing
        && inv.drm.iter().any(|d| d.driver.as_deref() == Some("vgem"));
    let r = if have { Ok(()) } else { Err(format!("devices missing here:\n{inv}")) };
    if common::or_skip("kernel_lane_sees_every_device", r).is_none() {
        return;
    }
    assert!(inv.heaps.iter().find(|h| h.path.ends_with("system")).unwrap().access.allowed());
    assert!(inv.udmabuf.access.allowed());
    assert!(inv.udmabuf_limit_mb.is_some());
    let card = inv.drm.iter().find(|d| d.kind == DrmNodeKind::Card && d.driver.as_deref() == Some("vgem")).unwrap();
    assert!(card.node.access.allowed());
}

#[test]
fn discovery_reads_a_tree_we_control() {
    let root = common::TempDir::new("disc");
    let dev = root.0.join("dev");
    let sys = root.0.join("sys");
    std::fs::create_dir_all(dev.join("dma_heap")).unwrap();
    std::fs::create_dir_all(dev.join("dri")).unwrap();
    for f in ["dma_heap/system", "dma_heap/linux,cma", "dri/card1", "dri/renderD129", "dri/by-path"] {
        std::fs::write(dev.join(f), b"").unwrap();
    }
    std::fs::create_dir_all(sys.join("class/drm/card1/device")).unwrap();
    std::fs::create_dir_all(sys.join("bus/platform/drivers/vgem")).unwrap();
    std::os::unix::fs::symlink(sys.join("bus/platform/drivers/vgem"), sys.join("class/drm/card1/device/driver"))
        .unwrap();
    std::fs::create_dir_all(sys.join("module/udmabuf/parameters")).unwrap();
    std::fs::write(sys.join("module/udmabuf/parameters/size_limit_mb"), b"128\n").unwrap();

    let inv = discovery::discover_at(&dev, &sys);
    let heaps: Vec<_> = inv.heaps.iter().map(|h| h.path.file_name().unwrap().to_str().unwrap().to_string()).collect();
    assert_eq!(heaps, ["linux,cma", "system"]);
    assert_eq!(inv.drm.len(), 2, "{:?}", inv.drm);
    assert_eq!(inv.drm[0].kind, DrmNodeKind::Card);
    assert_eq!(inv.drm[0].driver.as_deref(), Some("vgem"));
    assert_eq!(inv.drm[1].kind, DrmNodeKind::Render);
    assert_eq!(inv.drm[1].driver, None);
    assert_eq!(inv.udmabuf.access, NodeAccess::Missing);
    assert_eq!(inv.udmabuf_limit_mb, Some(128));
    let table = inv.to_string();
    assert!(table.contains("card vgem") && table.contains("limit 128 MiB") && table.contains("missing"), "{table}");
}

/// The CLI binary: where cargo built it, or where the kernel lane put it (`DMABUF_RT_BIN`).
fn cli() -> Command {
    Command::new(std::env::var_os("DMABUF_RT_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_dmabuf-rt").into()))
}

#[test]
fn cli_prints_the_table() {
    let out = cli().arg("devices").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("class"), "{text}");
    assert!(text.contains("udmabuf") && text.contains("heap") && text.contains("drm"), "{text}");
    assert_eq!(text, discovery::discover().to_string());

    let bad = cli().arg("frobnicate").output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown command `frobnicate`"));
}
