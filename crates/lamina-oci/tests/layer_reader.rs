//! The verifying layer stream: digest, diff_id and compression failures.

mod common;

use std::io::{self, Read};

use common::{gzip, layer_tar, zstd};
use lamina_oci::{media_types as mt, Compression, Descriptor, Digest, LayerReader, OciError};

fn read_layer(
    blob: &[u8],
    desc: &Descriptor,
    c: Compression,
    diff_id: &Digest,
) -> io::Result<Vec<u8>> {
    let raw: Box<dyn Read + Send> = Box::new(io::Cursor::new(blob.to_vec()));
    let mut r = LayerReader::new(raw, desc, c, diff_id.clone()).map_err(OciError::into_io)?;
    let mut out = Vec::new();
    // Small reads to exercise the state machine.
    let mut buf = [0u8; 100];
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    // Reads after the end keep returning 0.
    assert_eq!(r.read(&mut buf)?, 0);
    Ok(out)
}

fn tar_data() -> Vec<u8> {
    let big: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    layer_tar(&[("a", b"alpha"), ("big", &big)])
}

fn inner(err: &io::Error) -> &OciError {
    assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
    OciError::from_io(err).unwrap_or_else(|| panic!("no OciError inside {err:?}"))
}

#[test]
fn good_layers_in_all_compressions() {
    let tar = tar_data();
    let diff = Digest::of_bytes(&tar);
    for c in [Compression::None, Compression::Gzip, Compression::Zstd] {
        let blob = common::compress(&tar, c);
        let desc = Descriptor::of_bytes(c.oci_layer_media_type(), &blob);
        assert_eq!(
            read_layer(&blob, &desc, c, &diff).expect("good"),
            tar,
            "{c:?}"
        );
    }
}

#[test]
fn multi_member_gzip_and_multi_frame_zstd() {
    let tar = tar_data();
    let (a, b) = tar.split_at(5000);
    let diff = Digest::of_bytes(&tar);
    let mut blob = gzip(a);
    blob.extend(gzip(b));
    let desc = Descriptor::of_bytes(mt::OCI_LAYER_GZIP, &blob);
    assert_eq!(
        read_layer(&blob, &desc, Compression::Gzip, &diff).expect("gz"),
        tar
    );
    let mut blob = zstd(a);
    blob.extend(zstd(b));
    let desc = Descriptor::of_bytes(mt::OCI_LAYER_ZSTD, &blob);
    assert_eq!(
        read_layer(&blob, &desc, Compression::Zstd, &diff).expect("zstd"),
        tar
    );
}

#[test]
fn wrong_blob_digest() {
    let tar = tar_data();
    let diff = Digest::of_bytes(&tar);
    for c in [Compression::None, Compression::Gzip, Compression::Zstd] {
        let blob = common::compress(&tar, c);
        let mut desc = Descriptor::of_bytes(c.oci_layer_media_type(), &blob);
        desc.digest = Digest::of_bytes(b"something else");
        let err = read_layer(&blob, &desc, c, &diff).expect_err("digest");
        assert!(
            matches!(inner(&err), OciError::DigestMismatch { .. }),
            "{c:?}: {err}"
        );
        assert!(err.to_string().contains("digest mismatch"), "{err}");
    }
}

#[test]
fn wrong_size() {
    let tar = tar_data();
    let blob = gzip(&tar);
    let diff = Digest::of_bytes(&tar);
    for delta in [-1i64, 1] {
        let mut desc = Descriptor::of_bytes(mt::OCI_LAYER_GZIP, &blob);
        desc.size = (desc.size as i64 + delta) as u64;
        let err = read_layer(&blob, &desc, Compression::Gzip, &diff).expect_err("size");
        assert!(
            matches!(inner(&err), OciError::SizeMismatch { .. }),
            "{err}"
        );
    }
}

#[test]
fn wrong_diff_id() {
    let tar = tar_data();
    for c in [Compression::None, Compression::Gzip, Compression::Zstd] {
        let blob = common::compress(&tar, c);
        let desc = Descriptor::of_bytes(c.oci_layer_media_type(), &blob);
        let err = read_layer(&blob, &desc, c, &Digest::of_bytes(b"nope")).expect_err("diff");
        assert!(
            matches!(inner(&err), OciError::DiffIdMismatch { .. }),
            "{c:?}: {err}"
        );
    }
}

#[test]
fn truncated_compressed_data() {
    let tar = tar_data();
    let diff = Digest::of_bytes(&tar);
    for c in [Compression::Gzip, Compression::Zstd] {
        let full = common::compress(&tar, c);
        for cut in [full.len() / 2, full.len() - 4, 10] {
            let blob = &full[..cut];
            // Descriptor matches the truncated blob, so only decompression can notice.
            let desc = Descriptor::of_bytes(c.oci_layer_media_type(), blob);
            let err = read_layer(blob, &desc, c, &diff).expect_err("truncated");
            assert!(
                matches!(inner(&err), OciError::Decompress { .. }),
                "{c:?} cut {cut}: {err}"
            );
        }
        // Descriptor of the full blob, truncated transfer.
        let desc = Descriptor::of_bytes(c.oci_layer_media_type(), &full);
        let err = read_layer(&full[..full.len() / 2], &desc, c, &diff).expect_err("short");
        assert!(
            matches!(inner(&err), OciError::SizeMismatch { .. }),
            "{c:?}: {err}"
        );
    }
}

#[test]
fn garbage_bytes() {
    let garbage: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 256) as u8).collect();
    let diff = Digest::of_bytes(b"whatever");
    for (c, mut blob) in [
        (Compression::Gzip, vec![0x1f, 0x8b, 8, 0]),
        (Compression::Zstd, vec![0x28, 0xb5, 0x2f, 0xfd]),
        (Compression::Gzip, vec![]),
        (Compression::Zstd, vec![]),
    ] {
        blob.extend_from_slice(&garbage);
        let desc = Descriptor::of_bytes(c.oci_layer_media_type(), &blob);
        let err = read_layer(&blob, &desc, c, &diff).expect_err("garbage");
        assert!(
            matches!(inner(&err), OciError::Decompress { .. }),
            "{c:?}: {err}"
        );
    }
    // Garbage with a wrong blob digest: the digest mismatch is reported.
    let mut desc = Descriptor::of_bytes(mt::OCI_LAYER_GZIP, &garbage);
    desc.digest = Digest::of_bytes(b"other");
    let err = read_layer(&garbage, &desc, Compression::Gzip, &diff).expect_err("garbage");
    assert!(
        matches!(inner(&err), OciError::DigestMismatch { .. }),
        "{err}"
    );
}

#[test]
fn trailing_garbage_is_hashed() {
    let tar = tar_data();
    let diff = Digest::of_bytes(&tar);
    let mut blob = gzip(&tar);
    let good_desc = Descriptor::of_bytes(mt::OCI_LAYER_GZIP, &blob);
    blob.extend_from_slice(b"TRAILING");
    // The descriptor of the clean blob does not match the blob with trailer.
    let err = read_layer(&blob, &good_desc, Compression::Gzip, &diff).expect_err("trailer");
    assert!(
        matches!(
            inner(&err),
            OciError::SizeMismatch { .. } | OciError::DigestMismatch { .. }
        ),
        "{err}"
    );
    // A descriptor over the trailer is still checked (and here decompression
    // refuses the trailing bytes).
    let desc = Descriptor::of_bytes(mt::OCI_LAYER_GZIP, &blob);
    let err = read_layer(&blob, &desc, Compression::Gzip, &diff).expect_err("trailer2");
    assert!(matches!(inner(&err), OciError::Decompress { .. }), "{err}");
}

#[test]
fn media_types_and_sniffing() {
    assert_eq!(
        Compression::from_media_type(mt::DOCKER_LAYER_GZIP),
        Some(Compression::Gzip)
    );
    assert_eq!(
        Compression::from_media_type(mt::DOCKER_LAYER_TAR),
        Some(Compression::None)
    );
    assert_eq!(
        Compression::from_media_type(mt::OCI_LAYER_ZSTD),
        Some(Compression::Zstd)
    );
    assert_eq!(Compression::from_media_type(mt::OCI_CONFIG), None);
    assert_eq!(Compression::sniff(&gzip(b"x")), Compression::Gzip);
    assert_eq!(Compression::sniff(&zstd(b"x")), Compression::Zstd);
    assert_eq!(Compression::sniff(b"ustar"), Compression::None);
    assert_eq!(Compression::sniff(&[]), Compression::None);
}
