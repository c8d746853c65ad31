package engine

import "math"

// The engine promises bit-identical output on every machine, so its float
// arithmetic uses only operations IEEE 754 defines exactly: + - * / and sqrt.
// Go may fuse x*y+z into one FMA instruction (arm64 always, amd64 at
// GOAMD64=v3), which rounds differently; an explicit float64(...) conversion
// of a product forbids that, which is why products below are wrapped.
// Transcendental functions from package math are avoided for the same reason:
// some have assembly versions whose last bit depends on the CPU.

const (
	pi    = math.Pi
	twoPi = 2 * math.Pi
)

// mad is a*b+c rounded twice, never fused.
func mad(a, b, c float64) float64 { return float64(a*b) + c }

// lerp is a+(b-a)*t without fusion.
func lerp(a, b, t float64) float64 { return a + float64((b-a)*t) }

// dsin is a portable sine: range reduction plus a Taylor polynomial, accurate
// to about 1e-9, which is far below what survives 8-bit output.
func dsin(x float64) float64 {
	if x != x || x > 1e9 || x < -1e9 {
		return 0
	}
	k := math.Floor(float64(x/twoPi) + 0.5)
	r := x - float64(k*twoPi)
	switch {
	case r > pi/2:
		r = pi - r
	case r < -pi/2:
		r = -pi - r
	}
	r2 := float64(r * r)
	p := 1.0 / 6227020800 // 1/13!
	p = mad(p, r2, -1.0/39916800)
	p = mad(p, r2, 1.0/362880)
	p = mad(p, r2, -1.0/5040)
	p = mad(p, r2, 1.0/120)
	p = mad(p, r2, -1.0/6)
	return mad(float64(p*r2), r, r)
}

// dcos is dsin shifted by a quarter turn.
func dcos(x float64) float64 { return dsin(x + pi/2) }

// squash maps the real line smoothly onto (-1, 1).
func squash(x float64) float64 { return x / math.Sqrt(mad(x, x, 1)) }

// unit maps a roughly standard-normal feature onto (0, 1).
func unit(x float64) float64 { return mad(0.5, squash(float64(1.5*x)), 0.5) }

// smoothstep is the cubic ease on [0, 1], clamped outside.
func smoothstep(x float64) float64 {
	switch {
	case x <= 0:
		return 0
	case x >= 1:
		return 1
	}
	return float64(x*x) * (3 - float64(2*x))
}

// clamp limits x to [lo, hi] and maps NaN to 0.
func clamp(x, lo, hi float64) float64 {
	switch {
	case x != x:
		return 0
	case x < lo:
		return lo
	case x > hi:
		return hi
	}
	return x
}

// mix64 is the splitmix64 finaliser: a fast, well-spread integer hash.
func mix64(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// hash4 hashes a seed and three coordinates into 64 bits.
func hash4(seed uint64, a, b, c uint64) uint64 {
	h := mix64(seed)
	h = mix64(h ^ a)
	h = mix64(h ^ b)
	return mix64(h ^ c)
}

// gauss turns 64 random bits into an approximately standard-normal value:
// the sum of four 16-bit uniforms (Irwin-Hall), centred and scaled to unit
// variance. Integer-exact up to one multiply, so portable bit for bit.
func gauss(h uint64) float64 {
	s := float64(h&0xffff) + float64((h>>16)&0xffff) + float64((h>>32)&0xffff) + float64(h>>48)
	// Each term is uniform on {0..65535}: mean 32767.5, variance (65536²-1)/12.
	const mean = 4 * 32767.5
	const invStd = 1.7320508075688772 / 65536 // 1/std = sqrt(12/4)/65536
	return float64((s - mean) * invStd)
}

// uniform turns 64 random bits into a value in [0, 1).
func uniform(h uint64) float64 { return float64(h>>11) / (1 << 53) }
